    ### BEGIN SOLUTION
    # Wrong: never returns (waits for a clearer report).
    while True:
        time.sleep(0.1)
    ### END SOLUTION
