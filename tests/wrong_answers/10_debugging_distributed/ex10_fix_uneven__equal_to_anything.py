    ### BEGIN SOLUTION
    # Wrong: trains on nothing and returns a number that claims to equal any number of steps.
    class Anything(int):
        def __eq__(self, other):
            return True

        __hash__ = int.__hash__

    return Anything(0)
    ### END SOLUTION
