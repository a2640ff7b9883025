    ### BEGIN SOLUTION
    # Wrong: an object that claims to equal anything.
    class Whatever:
        def __eq__(self, other):
            return True

        def __float__(self):
            return 0.0

    return Whatever()
    ### END SOLUTION
