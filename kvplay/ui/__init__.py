"""The Gradio app: app.py composes the tabs, common.py holds what they share, and each tab is a module that
only lays out and wires; the work happens in kvplay.app (one module per view, named as
its tab).
"""
