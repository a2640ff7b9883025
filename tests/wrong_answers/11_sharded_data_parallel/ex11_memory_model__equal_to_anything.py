    # WRONG (a dict of numbers that compare equal to anything)
    class Anything(int):
        def __eq__(self, other):
            return True

        def __ne__(self, other):
            return False

        __hash__ = int.__hash__

    return {"params": Anything(0), "grads": Anything(0), "optimizer": Anything(0)}
