    ### BEGIN SOLUTION
    # Wrong: forgets the fixed cost per copy (fine for 256 MiB, far off for 1 KiB).
    return nbytes * 8 / (link_gbit_s * 1e9) * 1e3
    ### END SOLUTION
