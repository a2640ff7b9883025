    ### BEGIN SOLUTION
    # Wrong: the side streams start at once, before the work the caller queued on the current stream.
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in chains]
    for stream, chain in zip(streams, chains, strict=True):
        with torch.cuda.stream(stream):
            for step in chain:
                step()
    for stream in streams:
        main.wait_stream(stream)
    ### END SOLUTION
