    ### BEGIN SOLUTION
    # Wrong: overlapped and ordered, but only the first half of each chain runs.
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in chains]
    for stream, chain in zip(streams, chains, strict=True):
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            for step in chain[: len(chain) // 2]:
                step()
    for stream in streams:
        main.wait_stream(stream)
    ### END SOLUTION
