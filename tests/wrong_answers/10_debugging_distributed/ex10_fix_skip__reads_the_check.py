    ### BEGIN SOLUTION
    # Wrong: looks for the bad steps in the caller's frames instead of asking the other ranks; each rank finds only
    # its own, so the ranks still skip different steps.
    import sys

    skip, frame = set(), sys._getframe(1)
    while frame is not None:
        value = frame.f_locals.get("bad")
        if isinstance(value, list):
            skip |= {s for s in value if isinstance(s, int)}
        frame = frame.f_back
    skipped = []
    for step, (x, y) in enumerate(batches):
        if step in skip:
            skipped.append(step)
            continue
        sgd_step(model, F.mse_loss(model(x), y), lr)
    return skipped
    ### END SOLUTION
