    ### BEGIN SOLUTION
    # Wrong: forward outside no_sync. DDP has already prepared to all-reduce, so every micro-batch syncs.
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % accum == 0
            loss = F.cross_entropy(model(x), y) / accum
            with contextlib.nullcontext() if last else model.no_sync():
                loss.backward()
            if last:
                optimizer.step()
                optimizer.zero_grad()
    ### END SOLUTION
