    ### BEGIN SOLUTION
    # Wrong: objects that claim to equal anything.
    class Anything:
        def __eq__(self, other):
            return True

        __hash__ = object.__hash__

        def __float__(self):
            return 0.0

    return Anything(), Anything()
    ### END SOLUTION
