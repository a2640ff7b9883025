    ### BEGIN SOLUTION
    # Wrong: the current stream goes on without waiting for the side streams.
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in chains]
    for stream, chain in zip(streams, chains, strict=True):
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            for step in chain:
                step()
    ### END SOLUTION
