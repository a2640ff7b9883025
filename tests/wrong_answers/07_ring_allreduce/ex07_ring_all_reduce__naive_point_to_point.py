    ### BEGIN SOLUTION
    # Wrong: correct sums, but not a ring: every tensor goes to rank 0 and the sum comes back from it.
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank == 0:
        inbox = torch.empty_like(tensor)
        for src in range(1, n):
            dist.recv(inbox, src, group)
            tensor += inbox
        for dst in range(1, n):
            dist.send(tensor, dst, group)
    else:
        dist.send(tensor, 0, group)
        dist.recv(tensor, 0, group)
    ### END SOLUTION
