    ### BEGIN SOLUTION
    # Wrong: right values and one wait, but for the whole device: it also waits for other streams' work.
    dev = torch.get_device_module(losses[0].device)
    host = [loss.to("cpu", non_blocking=True) for loss in losses]
    dev.synchronize()
    return [h.item() for h in host]
    ### END SOLUTION
