    # Wrong: objects that claim to equal whatever they are compared with.
    class Anything:
        def __eq__(self, other):
            return True

        def __float__(self):
            return 0.0

    return Anything(), Anything(), Anything()
