    ### BEGIN SOLUTION
    # Wrong: agrees with MIN, so a step is skipped only when EVERY rank's loss is bad; NaNs get into the weights.
    skipped = []
    for step, (x, y) in enumerate(batches):
        loss = F.mse_loss(model(x), y)
        bad = torch.tensor([0.0 if torch.isfinite(loss) else 1.0])
        dist.all_reduce(bad, op=dist.ReduceOp.MIN)
        if bad.item() > 0:
            skipped.append(step)
            continue
        sgd_step(model, loss, lr)
    return skipped
    ### END SOLUTION
