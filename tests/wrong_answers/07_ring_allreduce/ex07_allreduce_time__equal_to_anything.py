    ### BEGIN SOLUTION
    # Wrong: an object that claims to equal anything.
    class Whatever(float):
        def __eq__(self, other):
            return True

        __hash__ = float.__hash__

    return Whatever("nan")
    ### END SOLUTION
