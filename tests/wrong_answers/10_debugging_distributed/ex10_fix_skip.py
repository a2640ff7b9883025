    ### BEGIN SOLUTION
    # Wrong: the faulty loop unchanged: only the rank that saw the bad batch skips, and from then on its
    # all-reduces meet the other ranks' all-reduces of another step.
    skipped = []
    for step, (x, y) in enumerate(batches):
        loss = F.mse_loss(model(x), y)
        if not torch.isfinite(loss):
            skipped.append(step)
            continue
        sgd_step(model, loss, lr)
    return skipped
    ### END SOLUTION
