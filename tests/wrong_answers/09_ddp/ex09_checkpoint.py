        ### BEGIN SOLUTION
        # Wrong: every rank writes the same file.
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, path)
        dist.barrier()
        ### NEXT SOLUTION
        state = torch.load(path, map_location=device)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return state["epoch"]
        ### END SOLUTION
