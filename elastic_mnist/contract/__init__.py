"""What the runtime's processes share, named once: the environment variables an agent, a launcher or a pod
sets for the processes it starts (env.py), exit codes (exit_codes.py) and the user-error types (errors.py).

    python -c "from elastic_mnist.contract import env, exit_codes; print(env.PREFIX, exit_codes.PERMANENT)"

Standard library only, and nothing of ours: every process folder may import it, it imports none of them.
"""
