    # WRONG (numbers that compare equal to anything)
    class Anything(float):
        def __eq__(self, other):
            return True

        __hash__ = float.__hash__

    return [(Anything(1), Anything(0), Anything(0)) for _ in grads]
