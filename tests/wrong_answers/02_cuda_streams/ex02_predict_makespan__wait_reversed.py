    ### BEGIN SOLUTION
    # Wrong: reads ("wait", a, b) as b waiting for a.
    free_at, end = {}, 0.0
    for op, a, b in schedule:
        if op == "sleep":
            free_at[a] = free_at.get(a, 0.0) + b
            end = max(end, free_at[a])
        else:
            free_at[b] = max(free_at.get(b, 0.0), free_at.get(a, 0.0))
    return end
    ### END SOLUTION
