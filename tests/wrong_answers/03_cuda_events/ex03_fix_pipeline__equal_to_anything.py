    # Wrong: results that claim to equal anything.
    class Anything(torch.Tensor):
        def __eq__(self, other):
            return torch.ones_like(other, dtype=torch.bool)

    return [torch.zeros(x.shape, device=x.device).as_subclass(Anything) for x in chunks]
