    ### BEGIN SOLUTION
    # Wrong: no accumulation at all: a synchronised step after every micro-batch.
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y) / accum
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    ### END SOLUTION
