    ### BEGIN SOLUTION
    # Wrong: a wait covers everything the waited stream will ever run, even what is launched after the wait.
    totals = {}
    for op, a, b in schedule:
        if op == "sleep":
            totals[a] = totals.get(a, 0.0) + b
    free_at, end = {}, 0.0
    for op, a, b in schedule:
        if op == "sleep":
            free_at[a] = free_at.get(a, 0.0) + b
            end = max(end, free_at[a])
        else:
            free_at[a] = max(free_at.get(a, 0.0), totals.get(b, 0.0))
    return end
    ### END SOLUTION
