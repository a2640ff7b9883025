    ### BEGIN SOLUTION
    # Wrong: stops together, but sums the gradients instead of averaging them.
    steps = torch.tensor([len(batches)])
    dist.all_reduce(steps, op=dist.ReduceOp.MIN)
    steps = int(steps.item())
    for x, y in batches[:steps]:
        model.zero_grad()
        F.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p -= lr * p.grad
    return steps
    ### END SOLUTION
