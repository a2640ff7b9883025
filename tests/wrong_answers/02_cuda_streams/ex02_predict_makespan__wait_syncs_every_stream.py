    ### BEGIN SOLUTION
    # Wrong: treats a wait like torch.cuda.synchronize(): every stream waits for all work so far.
    free_at, end = {}, 0.0
    for op, a, b in schedule:
        if op == "sleep":
            free_at[a] = free_at.get(a, 0.0) + b
            end = max(end, free_at[a])
        else:
            latest = max(free_at.values(), default=0.0)
            free_at = dict.fromkeys(set(free_at) | {a, b}, latest)
    return end
    ### END SOLUTION
