"""The streaming pipeline: stage runners and a scheduler; no sockets.

request.py   Request (plain Python) and the messages the pipeline posts back to a session
inbox.py     a stage's inbox: Condition-woken, never polled
scheduler.py Pipeline: Thinker, Talker and Code2Wav threads and the policy between them (no torch)
stages.py    what the scheduler needs from a stage runner (ints in, ints / numpy PCM out)
runners.py   the real runners (what they share; build_runners): caches, samplers, CUDA graphs (torch)
             thinker_runner.py, talker_runner.py, code2wav_runner.py: one a stage
fake.py      scripted-duration fake runners for policy tests
graphs.py    CUDA-graph capture helpers
"""
