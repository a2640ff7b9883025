    ### BEGIN SOLUTION
    # Wrong: never skips: a bad loss is replaced by zero and the step goes on (its NaN gradients are all-reduced).
    for x, y in batches:
        loss = F.mse_loss(model(x), y)
        if not torch.isfinite(loss):
            loss = loss.nan_to_num(0.0)
        sgd_step(model, loss, lr)
    return []
    ### END SOLUTION
