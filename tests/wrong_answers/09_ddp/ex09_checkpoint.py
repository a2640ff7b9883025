    ### BEGIN SOLUTION
    # Wrong: every rank writes the same file.
    @staticmethod
    def save(model, optimizer, epoch, path):
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, path)
        dist.barrier()

    @staticmethod
    def load(model, optimizer, path, device):
        state = torch.load(path, map_location=device)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        return state["epoch"]
    ### END SOLUTION
