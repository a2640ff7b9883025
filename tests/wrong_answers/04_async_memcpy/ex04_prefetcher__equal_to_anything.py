    ### BEGIN SOLUTION
    # Wrong: yields objects that claim to equal anything (and to be on the device asked for).
    class Anything:
        def __init__(self, t):
            self.device, self.shape, self.dtype = torch.device(device), t.shape, t.dtype

        def __eq__(self, other):
            return True

        __hash__ = object.__hash__

        def __mul__(self, other):
            return self

        def __add__(self, other):
            return self

    for batch in batches:
        yield Anything(batch)
    ### END SOLUTION
