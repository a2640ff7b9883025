    ### BEGIN SOLUTION
    # Wrong (a measurement fake): rebuild every step with a tenth of its sleep, then run it all on one stream.
    import functools

    def shorter(step):
        if not isinstance(step, functools.partial):
            return step
        args = [a // 10 if type(a) is int and a > 10_000 else a for a in step.args]
        return functools.partial(step.func, *args, **step.keywords)

    for chain in chains:
        for step in chain:
            shorter(step)()
    ### END SOLUTION
