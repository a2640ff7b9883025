    ### BEGIN SOLUTION
    # Wrong: receives the halos into the ends of its own block (overwriting the caller's data).
    rank, world = dist.get_rank(), dist.get_world_size()
    left_peer, right_peer = (rank - 1) % world, (rank + 1) % world
    first, last = block[:width].clone(), block[-width:].clone()
    ops = [dist.P2POp(dist.isend, first, left_peer),
           dist.P2POp(dist.isend, last, right_peer),
           dist.P2POp(dist.irecv, block[-width:], right_peer),
           dist.P2POp(dist.irecv, block[:width], left_peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return block[:width].clone(), block[-width:].clone()
    ### END SOLUTION
