    ### BEGIN SOLUTION
    # Wrong: blocking send, then blocking recv, in ring order: every rank waits in send for a receive that its
    # neighbour only posts after its own send returns.
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = tensor.view(-1).tensor_split(n)
    inbox = torch.empty_like(chunks[0])
    for step in range(n - 1):
        send, recv = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
        dist.send(send, right, group)
        dist.recv(inbox[: recv.numel()], left, group)
        recv += inbox[: recv.numel()]
    for step in range(n - 1):
        send, recv = chunks[(rank + 1 - step) % n], chunks[(rank - step) % n]
        dist.send(send, right, group)
        dist.recv(recv, left, group)
    ### END SOLUTION
