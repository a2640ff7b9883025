    ### BEGIN SOLUTION
    # Wrong: every micro-batch inside no_sync, the last one too: the ranks never all-reduce and drift apart.
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            with model.no_sync():
                loss = F.cross_entropy(model(x), y) / accum
                loss.backward()
            if (i + 1) % accum == 0:
                optimizer.step()
                optimizer.zero_grad()
    ### END SOLUTION
