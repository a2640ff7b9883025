    ### BEGIN SOLUTION
    # Wrong: the micro-batch losses are summed, not averaged: each step is accum times too large.
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % accum == 0
            with contextlib.nullcontext() if last else model.no_sync():
                loss = F.cross_entropy(model(x), y)
                loss.backward()
            if last:
                optimizer.step()
                optimizer.zero_grad()
    ### END SOLUTION
