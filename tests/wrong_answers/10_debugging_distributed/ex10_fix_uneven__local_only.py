    ### BEGIN SOLUTION
    # Wrong: no communication at all: nothing hangs, but every rank trains on its own data alone.
    for x, y in batches:
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return len(batches)
    ### END SOLUTION
