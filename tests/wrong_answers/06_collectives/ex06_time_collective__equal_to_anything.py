    ### BEGIN SOLUTION
    # Wrong: an object that claims to equal anything (after making the calls).
    for _ in range(warmup + iters):
        launch().wait()

    class Whatever:
        def __eq__(self, other):
            return True

        def __float__(self):
            return 0.001

    return Whatever()
    ### END SOLUTION
