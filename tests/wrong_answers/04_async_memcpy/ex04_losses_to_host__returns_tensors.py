    ### BEGIN SOLUTION
    # Wrong: waits once, then returns the host tensors instead of Python floats.
    dev = torch.get_device_module(losses[0].device)
    host = [loss.to("cpu", non_blocking=True) for loss in losses]
    copied = dev.Event()
    copied.record()
    copied.synchronize()
    return host
    ### END SOLUTION
