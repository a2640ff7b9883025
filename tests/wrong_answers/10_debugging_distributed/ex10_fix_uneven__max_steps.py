    ### BEGIN SOLUTION
    # Wrong: agrees on the longest rank's number of batches; the shorter ranks run out and stop early.
    steps = torch.tensor([len(batches)])
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    steps = int(steps.item())
    for x, y in batches[:steps]:
        sgd_step(model, F.mse_loss(model(x), y), lr)
    return steps
    ### END SOLUTION
