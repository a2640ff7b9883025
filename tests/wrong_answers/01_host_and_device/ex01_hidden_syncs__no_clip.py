    opt.zero_grad(set_to_none=True)
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    # Wrong: no reads, but the norm is computed without clipping, so the update differs.
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    opt.step()
    acc = (out.argmax(dim=1) == y).float().mean()
    history.append({"loss": loss.detach(), "grad_norm": grad_norm, "acc": acc})
