    ### BEGIN SOLUTION
    # Wrong: one side stream for every chain, so the chains still run one after another.
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        for chain in chains:
            for step in chain:
                step()
    main.wait_stream(side)
    ### END SOLUTION
