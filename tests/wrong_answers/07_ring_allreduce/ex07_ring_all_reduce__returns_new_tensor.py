    ### BEGIN SOLUTION
    # Wrong: a correct ring on a copy, returned; the caller's tensor is left as it was.
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    out = tensor.clone()
    if n == 1:
        return out
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = out.view(-1).tensor_split(n)
    inbox = torch.empty_like(chunks[0])
    for step in range(n - 1):
        send, recv = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
        into = inbox[: recv.numel()]
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right, group),
                                            dist.P2POp(dist.irecv, into, left, group)]):
            work.wait()
        recv += into
    for step in range(n - 1):
        send, recv = chunks[(rank + 1 - step) % n], chunks[(rank - step) % n]
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right, group),
                                            dist.P2POp(dist.irecv, recv, left, group)]):
            work.wait()
    return out
    ### END SOLUTION
