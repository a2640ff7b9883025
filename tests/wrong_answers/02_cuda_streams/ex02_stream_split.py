    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):  # one side stream for everything: the chains still run one after another
        for chain in workload.chains:
            for step in chain:
                step()
    main.wait_stream(side)
