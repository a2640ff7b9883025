    ### BEGIN SOLUTION
    # Wrong: a wait covers only the waited stream's own kernels, not what that stream itself waited for.
    own_end, free_at, end = {}, {}, 0.0
    for op, a, b in schedule:
        if op == "sleep":
            free_at[a] = free_at.get(a, 0.0) + b
            own_end[a] = free_at[a]
            end = max(end, free_at[a])
        else:
            free_at[a] = max(free_at.get(a, 0.0), own_end.get(b, 0.0))
    return end
    ### END SOLUTION
