    ### BEGIN SOLUTION
    # Wrong: the sampler is never told the epoch, so every epoch repeats epoch 0's order.
    for epoch in range(epochs):
        for i, (x, y) in enumerate(loader):
            last = (i + 1) % accum == 0
            with contextlib.nullcontext() if last else model.no_sync():
                loss = F.cross_entropy(model(x), y) / accum
                loss.backward()
            if last:
                optimizer.step()
                optimizer.zero_grad()
    ### END SOLUTION
