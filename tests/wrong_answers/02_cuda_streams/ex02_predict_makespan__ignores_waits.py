    ### BEGIN SOLUTION
    # Wrong: streams run concurrently, but waits are ignored: the longest stream's total.
    totals = {}
    for op, a, b in schedule:
        if op == "sleep":
            totals[a] = totals.get(a, 0.0) + b
    return max(totals.values(), default=0.0)
    ### END SOLUTION
