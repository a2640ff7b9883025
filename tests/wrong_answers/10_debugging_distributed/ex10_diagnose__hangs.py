    ### BEGIN SOLUTION
    # Wrong: waits for a report that would say it all.
    while "culprit" not in report:
        time.sleep(0.1)
    return 0, "crash", 1
    ### END SOLUTION
