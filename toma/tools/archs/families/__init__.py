"""One module per arch family: its published and tiny configs, the config keys ``--depth``
divides, and the builder of one denoiser call's inputs. Torch loads inside the builders."""
