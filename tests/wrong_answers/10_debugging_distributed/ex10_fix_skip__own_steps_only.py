    ### BEGIN SOLUTION
    # Wrong: every rank skips together, but reports only the steps where its own loss was bad.
    skipped = []
    for step, (x, y) in enumerate(batches):
        loss = F.mse_loss(model(x), y)
        mine = not torch.isfinite(loss)
        bad = torch.tensor([1.0 if mine else 0.0])
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item() > 0:
            if mine:
                skipped.append(step)
            continue
        sgd_step(model, loss, lr)
    return skipped
    ### END SOLUTION
