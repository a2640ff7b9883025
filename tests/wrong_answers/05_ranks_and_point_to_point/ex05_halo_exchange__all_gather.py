    ### BEGIN SOLUTION
    # Wrong: gathers every block with a collective instead of exchanging halos point to point.
    rank, world = dist.get_rank(), dist.get_world_size()
    blocks = [None] * world
    dist.all_gather_object(blocks, block)
    return blocks[(rank - 1) % world][-width:].clone(), blocks[(rank + 1) % world][:width].clone()
    ### END SOLUTION
