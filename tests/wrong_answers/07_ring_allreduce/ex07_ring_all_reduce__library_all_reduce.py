    ### BEGIN SOLUTION
    # Wrong: the library's collective, which this exercise replaces.
    dist.all_reduce(tensor, group=group)
    ### END SOLUTION
