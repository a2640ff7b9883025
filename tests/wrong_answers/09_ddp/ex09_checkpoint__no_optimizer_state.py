        ### BEGIN SOLUTION
        # Wrong: the weights only: training resumes with a fresh optimizer (no momentum, no Adam moments).
        if dist.get_rank() == 0:
            torch.save({"model": model.module.state_dict(), "optimizer": {}, "epoch": epoch}, path)
        dist.barrier()
        ### NEXT SOLUTION
        state = torch.load(path, map_location=device)
        model.module.load_state_dict(state["model"])
        return state["epoch"]
        ### END SOLUTION
