    # Wrong: an object that claims to equal every number.
    class Anything:
        def __eq__(self, other):
            return True

    return Anything()
