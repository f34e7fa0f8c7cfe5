"""What the CLI shares with the daemon: the control protocol's codec and checks, the one
bounded JSON decoder, and the default paths. Standard library only, and nothing of elasticd
outside this folder: elasticctl imports these and nothing else of the daemon."""
