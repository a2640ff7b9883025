    ### BEGIN SOLUTION
    # Wrong: zero_grad before every micro-batch throws away what the earlier ones accumulated.
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % accum == 0
            optimizer.zero_grad()
            with contextlib.nullcontext() if last else model.no_sync():
                loss = F.cross_entropy(model(x), y) / accum
                loss.backward()
            if last:
                optimizer.step()
    ### END SOLUTION
