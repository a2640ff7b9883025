    ### BEGIN SOLUTION
    # Wrong: chunks of numel // n elements; the last numel % n elements are never sent or summed.
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return
    right, left = (rank + 1) % n, (rank - 1) % n
    size = tensor.numel() // n
    chunks = [tensor.view(-1)[i * size:(i + 1) * size] for i in range(n)]
    inbox = torch.empty_like(chunks[0])
    for step in range(n - 1):
        send, recv = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right, group),
                                            dist.P2POp(dist.irecv, inbox, left, group)]):
            work.wait()
        recv += inbox
    for step in range(n - 1):
        send, recv = chunks[(rank + 1 - step) % n], chunks[(rank - step) % n]
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, send, right, group),
                                            dist.P2POp(dist.irecv, recv, left, group)]):
            work.wait()
    ### END SOLUTION
