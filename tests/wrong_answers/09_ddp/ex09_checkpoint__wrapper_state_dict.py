        ### BEGIN SOLUTION
        # Wrong: DDP's own state_dict: every name starts with "module.", and only a DDP model can load it.
        if dist.get_rank() == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, path)
        dist.barrier()
        ### NEXT SOLUTION
        state = torch.load(path, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return state["epoch"]
        ### END SOLUTION
